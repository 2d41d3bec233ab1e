"""Names of the HF architectures mrv2 implements (torch-free, so loaders can check early)."""

DECODER_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
)
MLA_ARCHITECTURES: tuple[str, ...] = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
SUPPORTED_ARCHITECTURES: tuple[str, ...] = DECODER_ARCHITECTURES + MLA_ARCHITECTURES
