"""fmoe2 inside other libraries: :mod:`fmoe2.integrations.transformers` (Hugging Face transformers'
experts backend). Import the submodule you need; this package imports none of them."""
