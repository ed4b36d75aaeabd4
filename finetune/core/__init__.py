"""Foundations (layer 1): errors, secrets, the typed config schemas and their Hydra composition, and the
pure facts every layer reads (architectures, methods, tasks). Stdlib only at import, except `composition`,
which imports Hydra inside its functions."""
