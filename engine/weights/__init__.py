"""A model's weights: reading the embedded GGUF (gguf, gguf_tokenizer), choosing the format
a model is served in (formats) and converting quantized layers to dense ones (dequantize)."""
