"""Tiny and real-config models built from ComfyUI's own classes, run inside ComfyUI's Python (the bench's ComfyUI parts and the ComfyUI tests)."""
