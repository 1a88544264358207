"""The real diffusers configs of the SD1.5 and SDXL UNets and the SD VAE: one source for the demo's real-depth
models, the tests and the benchmark (standard library only, so the benchmark's import stays free of torch)."""

# The real configs (diffusers' config.json of each checkpoint, defaults left out).
SD15_UNET = dict(
    sample_size=64, in_channels=4, out_channels=4, cross_attention_dim=768, attention_head_dim=8,
    block_out_channels=(320, 640, 1280, 1280), layers_per_block=2, norm_num_groups=32,
    down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
)
SDXL_UNET = dict(
    sample_size=128, in_channels=4, out_channels=4, cross_attention_dim=2048, attention_head_dim=(5, 10, 20),
    block_out_channels=(320, 640, 1280), layers_per_block=2, norm_num_groups=32,
    transformer_layers_per_block=(1, 2, 10), use_linear_projection=True, upcast_attention=False,
    addition_embed_type="text_time", addition_time_embed_dim=256, projection_class_embeddings_input_dim=2816,
    down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
    up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
)
SD_VAE = dict(
    in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(128, 256, 512, 512), layers_per_block=2,
    norm_num_groups=32, sample_size=512,
    down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
)
