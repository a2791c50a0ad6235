"""Wing: which tree to decode with: the heads' measured acceptance table and `--tree`."""
