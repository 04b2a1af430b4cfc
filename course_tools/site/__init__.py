"""The static site of the lessons: build, page rendering and formulas."""
