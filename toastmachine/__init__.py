"""ToastMachine: the composition root (node assembly) and the command-line interface."""
