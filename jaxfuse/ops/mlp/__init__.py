"""A transformer's GELU MLP whose backward recomputes the activation."""
