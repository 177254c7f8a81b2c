"""What the engine tests share: the LoRA files they write, the LyCORIS oracle, tiny models and banks."""
