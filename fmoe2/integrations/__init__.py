"""fmoe2 inside other libraries: :mod:`fmoe2.integrations.transformers` (Hugging Face transformers'
experts backend), :mod:`fmoe2.integrations.peft` (PEFT LoRA adapters of the experts, unmerged, several
per batch). Import the submodule you need; this package imports none of them."""
