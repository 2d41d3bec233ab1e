"""Model building blocks: rotary embeddings, norms, linear layers."""
