"""The typed recipe: its sections (sections.py), the values' parsing and checks (values.py), and the Recipe that
puts them together (recipe.py)."""
