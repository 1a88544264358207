"""Image inputs beside the prompt with Model Speedup, in ComfyUI's own Python; run by test_comfyui_image_inputs.py.

    python kf_image_inputs.py PACK_DIR BASE_DIR FAMILY

FAMILY `flux` or `flux2`: ComfyUI's ReferenceLatent node (Flux Kontext, Flux 2 edits) adds reference images'
latents to the conditioning; the model joins their tokens to the image's, so a block sees more image tokens than
the latent alone gives. Calls with references inside the node's range are served by the graphs with no compile;
one past it (a 512-pixel image with a 512-pixel reference, range up to 512) runs eager, saying which tokens and
which node input covers them. FAMILY `wan22`: ComfyUI's Wan22ImageToVideoLatent with a start image (its noise
mask) makes Wan 2.2's 5B take one timestep per latent frame; text-to-video takes one per call. Both are served by
the one block graph. FAMILY `hunyuan-video15`: image-to-video (the start image's latent joined to the noise's
channels, its 729 SigLIP features joined to the prompt's tokens, as HunyuanVideo 1.5's nodes give them), with a
short prompt and a 400-token one (1129 text tokens), against text-to-video on the same graph. FAMILY `ltxv` or
`ltxav` (LTX-2): ComfyUI's LTXVImgToVideoInplace puts a start image's latent in the first frame with a noise mask,
so the model gives every token its own timestep (LTX-2: its audio latent from LTXVEmptyLatentAudio joined by
LTXVConcatAVLatent, its mask too); text-to-video gives one a sample. Both are served by the one block graph. Each
call against the same model without the node. Prints one JSON object after "KEEPFAST-RESULT ".
"""

from __future__ import annotations

import json
import sys

from kf_inprocess import BLOCKING_BUILD, family_in_comfy, served_calls  # noqa: E402  (this script's folder is on sys.path)

RANGE = dict(min_resolution=64, max_resolution=512, max_batch_size=2, compile=True, save_compiled=False,
             backend="aot", max_frames=17, build=BLOCKING_BUILD)
# (width, height, reference images (width, height)); the last is past the range: 1024 + 1024 image tokens.
REFERENCE_CALLS = [(128, 128, []), (128, 128, [(128, 128)]), (192, 128, [(128, 128), (64, 128)]),
                   (512, 512, [(512, 512)])]
# (width, height, video frames, start image)
START_IMAGE_CALLS = [(128, 128, 9, False), (128, 128, 9, True), (192, 128, 13, True), (128, 192, 9, False)]
# (width, height, video frames, start image, prompt tokens)
IMAGE_TO_VIDEO_CALLS = [(128, 128, 9, False, 7), (128, 128, 9, True, 7), (192, 128, 13, True, 7),
                        (128, 128, 9, True, 400)]
SIGLIP_TOKENS = 729
# (width, height, video frames, start image): LTXV and LTX-2, text-to-video and image-to-video
LTX_CALLS = [(128, 128, 9, False), (128, 128, 9, True), (192, 128, 17, True), (128, 192, 9, False)]


class _LTXVideoVAE:
    """What LTXVImgToVideoInplace reads of LTXV's VAE: its scale, and a latent of the start image."""

    downscale_index_formula = (8, 32, 32)

    def encode(self, pixels):
        import torch

        generator = torch.Generator().manual_seed(4)
        return torch.randn(1, 128, 1, pixels.shape[1] // 32, pixels.shape[2] // 32, generator=generator)


class _LTX2AudioVAE:
    """What LTXVEmptyLatentAudio reads of LTX-2's audio VAE (16 kHz, 25 latents a second, 8 x 16 a latent)."""

    latent_channels, latent_frequency_bins, sample_rate = 8, 16, 16000

    def num_of_latents_from_frames(self, frames: int, frame_rate: int) -> int:
        import math

        return math.ceil(frames / frame_rate * 25)


class _StartImageVAE:
    """Wan22ImageToVideoLatent encodes its start image with the VAE: a latent of the image's frames here."""

    def encode(self, pixels):
        import torch

        frames = 1 + (pixels.shape[0] - 1) // 4
        generator = torch.Generator().manual_seed(4)
        return torch.randn(1, 48, frames, pixels.shape[1] // 16, pixels.shape[2] // 16, generator=generator)


def main(pack: str, base: str, family_name: str) -> dict:
    env = family_in_comfy(pack, base, family_name)
    import torch
    import comfy.sample
    from benchmarks.comfy import families as F

    family = env.family
    fast = env.nodes["KeepFastModelSpeedup"].execute(model=family.patcher, **RANGE).args[0]

    def with_references(conditioning, references):
        from comfy_extras.nodes_edit_model import ReferenceLatent

        generator = torch.Generator().manual_seed(9)
        for width, height in references:
            latent = torch.randn(family.latent(width, height).shape, generator=generator)
            conditioning = ReferenceLatent.execute(conditioning=conditioning, latent={"samples": latent}).args[0]
        return conditioning

    def reference_sample(model, width, height, references):
        positive = with_references(family.conditioning(7, seed=1), references)
        negative = with_references(family.conditioning(7, seed=2), references)
        return F.sample(family, positive, negative, family.latent(width, height), model=model)

    def masked_sample(model, latent):
        """KSampler on a latent node's output, with its noise mask (a start image's frames kept)."""
        positive, negative = family.conditioning(7, seed=1), family.conditioning(7, seed=2)
        with torch.inference_mode():
            samples = latent["samples"]
            noise = comfy.sample.prepare_noise(samples, 3)
            return comfy.sample.sample(model, noise, 2, 2.0, "euler", "simple", positive, negative, samples,
                                       denoise=1.0, disable_pbar=True, seed=3, noise_mask=latent.get("noise_mask"))

    def start_image_sample(model, width, height, frames, start_image):
        from comfy_extras.nodes_wan import Wan22ImageToVideoLatent

        image = torch.rand(1, height, width, 3, generator=torch.Generator().manual_seed(5)) if start_image else None
        latent = Wan22ImageToVideoLatent.execute(vae=_StartImageVAE(), width=width, height=height, length=frames,
                                                 batch_size=1, start_image=image).args[0]
        return masked_sample(model, latent)

    def image_to_video_sample(model, width, height, frames, start_image, text):
        from types import SimpleNamespace

        latent = family.latent(width, height, frames=frames)
        positive, negative = family.conditioning(text, seed=1), family.conditioning(text, seed=2)
        if start_image:
            generator = torch.Generator().manual_seed(6)
            image = torch.randn((1, 32) + tuple(latent.shape[2:]), generator=generator)
            width_in = env.module.vision_in_dim
            vision = SimpleNamespace(last_hidden_state=torch.randn(1, SIGLIP_TOKENS, width_in, generator=generator))
            for conditioning in (positive, negative):
                conditioning[0][1].update(concat_latent_image=image, clip_vision_output=vision)
        return F.sample(family, positive, negative, latent, model=model)

    def ltx_sample(model, width, height, frames, start_image):
        from comfy_extras.nodes_lt import EmptyLTXVLatentVideo, LTXVConcatAVLatent, LTXVImgToVideoInplace
        from comfy_extras.nodes_lt_audio import LTXVEmptyLatentAudio

        latent = EmptyLTXVLatentVideo.execute(width=width, height=height, length=frames, batch_size=1).args[0]
        if start_image:
            image = torch.rand(1, height, width, 3, generator=torch.Generator().manual_seed(5))
            latent = LTXVImgToVideoInplace.execute(vae=_LTXVideoVAE(), image=image, latent=latent,
                                                   strength=1.0).args[0]
        if family_name == "ltxav":
            audio = LTXVEmptyLatentAudio.execute(frames_number=frames, frame_rate=25, batch_size=1,
                                                 audio_vae=_LTX2AudioVAE()).args[0]
            latent = LTXVConcatAVLatent.execute(video_latent=latent, audio_latent=audio).args[0]
        return masked_sample(model, latent)

    def parts(latent) -> list:
        return list(latent.unbind()) if getattr(latent, "is_nested", False) else [latent]

    calls, sample = {"wan22": (START_IMAGE_CALLS, start_image_sample),
                     "hunyuan-video15": (IMAGE_TO_VIDEO_CALLS, image_to_video_sample),
                     "ltxv": (LTX_CALLS, ltx_sample), "ltxav": (LTX_CALLS, ltx_sample)}.get(
        family_name, (REFERENCE_CALLS, reference_sample))
    rows = []
    for call in calls:
        before, mark = served_calls(env.name, env.module), len(env.registry.events)
        got = sample(fast, *call)
        after = served_calls(env.name, env.module)
        want = sample(family.patcher, *call)
        rows.append({"call": call, "diff": max(float((a - b).abs().max()) for a, b in zip(parts(got), parts(want))),
                     "scale": max(float(t.abs().max()) for t in parts(want)),
                     "events": {k: after[k] - before[k] for k in after},
                     "fallbacks": [e.reason for e in env.registry.events[mark:] if e.kind == "fallback"]})
    return {"family": family_name, "blocks": env.block_count(), "rows": rows}


if __name__ == "__main__":
    print("KEEPFAST-RESULT " + json.dumps(main(*sys.argv[1:4])))
