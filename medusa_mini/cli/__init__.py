"""Wing: the command lines' parts: running and comparing decodings, --compile, --explain, --tree, figures, measure."""
