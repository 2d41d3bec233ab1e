"""Names of the HF architectures mrv2 implements (torch-free, so loaders can check early)."""

DECODER_ARCHITECTURES: tuple[str, ...] = (
    "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM",
)
MLA_ARCHITECTURES: tuple[str, ...] = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
SUPPORTED_ARCHITECTURES: tuple[str, ...] = DECODER_ARCHITECTURES + MLA_ARCHITECTURES
# Draft heads (`mrv2.models.eagle`): vLLM's and SGLang's names for Eagle-1 and Eagle-3 Llama heads.
EAGLE_ARCHITECTURES: tuple[str, ...] = ("EagleLlamaForCausalLM", "LlamaForCausalLMEagle")
EAGLE3_ARCHITECTURES: tuple[str, ...] = ("Eagle3LlamaForCausalLM", "LlamaForCausalLMEagle3")
