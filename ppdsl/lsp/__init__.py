"""`ppdsl lsp`: an editor server for .ppspec files (diagnostics, hover, completion, definition).

Needs the optional extra `lsp` (pygls): `pip install 'ppdsl[lsp]'`. The pure parts (context,
docs, model_view) import neither pygls nor torch.
"""
