"""Notebook-side figures and widgets (plotly, ipywidgets). Rank-side code never imports this package."""
