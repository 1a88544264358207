"""The time-share line of the reports (compiler/serving/time_share.py): arithmetic on the registry's timed counters."""

from compiler.serving.time_share import TimeShare


def test_blocks_glue_and_vae_shares():
    share = TimeShare.from_seconds({"blocks.model": 10.0, "blocks.graph": 7.0, "blocks.eager": 1.0,
                                    "vae.graph": 3.0, "vae.eager": 1.0})
    assert share.glue_s == 2.0 and share.model_compiled == 0.7 and share.vae_compiled == 0.75
    assert share.describe() == ("time served: diffusion model 70% from graphs (blocks 70% from graphs, 10% eager; "
                                "glue 20% eager); VAE 75% from graphs")
    assert share.to_json()["glue_s"] == 2.0


def test_a_whole_unet_and_nothing_run_yet():
    assert TimeShare.from_seconds({"unet.graph": 3.0, "unet.eager": 1.0}).describe() == \
        "time served: diffusion model 75% from graphs"
    assert TimeShare.from_seconds({}).describe() == "" and TimeShare().model_compiled == 0.0
