"""What the web tests share: the browser behind bridge.mjs, page helpers, the LoRA files and workflows they use."""
