"""Wing: the train_tiny.py run: configuration, data, devices, the stages, the acceptance tables."""
