"""Models as files: GGUF reading (gguf-py), the tokenizer and chat template, the model
families and shapes, the named models strata knows, and the random-weight GGUF writer.
May import: kernels, config_error"""
