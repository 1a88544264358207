"""What runs inside a build process (torch and the standard library; entered by path through run.py)."""
