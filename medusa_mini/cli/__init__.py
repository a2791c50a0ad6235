"""Wing: what the command lines share: errors, devices, text output, --explain, the measure command."""
