"""Text in and out of token ids: the embedded tokenizer, incremental decoding, chat templates."""
