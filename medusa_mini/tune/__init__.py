"""Wing: measuring what trees to decode with: acceptance tables, step costs, stored trees, clocks."""
