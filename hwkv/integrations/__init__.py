"""Drivers of hwkv from other libraries. `hwkv.integrations.transformers`: Hugging Face models (imports
transformers only when a model is loaded or the attention function registered, never at `import hwkv`)."""
