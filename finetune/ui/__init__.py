"""`python -m finetune mode=ui`: the plan calculator and the runs as a local web page (docs/ui.md).

`server.serve(cfg.ui)` serves it; `calculator` turns the page's settings into the command line's plan,
`runs` reads the run directories, `pages` renders both as HTML and SVG.
"""
