"""Source code work: the libcst scanner, the @lora_convert decorator, the source rewriter and template rendering."""
