"""`cleaner view`: the trajectory viewer. app.py routes, store.py and table.py read the catalog,
tokens.py and align.py turn token ids into aligned text, trajectory.py and pages.py render, serve.py serves."""
