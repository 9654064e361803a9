"""Building blocks shared by the model architectures: norms, rotary embeddings, attention, indexer."""
