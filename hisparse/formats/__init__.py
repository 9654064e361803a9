"""The bottom of the import graph: how a cache stores a token (K/V rows, MLA latent rows, indexer keys), the
FP8 layouts, and the batch a step hands the model. Nothing here imports another hisparse package."""
