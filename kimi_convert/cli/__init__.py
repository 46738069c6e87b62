"""The command-line layer: one module per command (convert, quantize, verify), each a thin typer layer over
the library, over shared helpers (common, policy_options) that import no command."""
