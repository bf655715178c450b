"""Model code: config.json parsing, safetensors loading, llama-family layers, tokenizer."""
