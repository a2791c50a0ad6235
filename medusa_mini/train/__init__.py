"""Wing: the train_tiny.py run: data, configuration, stages, state, report."""
