"""`rollout-ledger report`: a static HTML page of one run's metrics, with figures beside it.

`data` reads what the page shows (through `store`), `downsample` buckets long runs into a bounded
number of points, `figures` decides what each figure draws (plain series, no matplotlib),
`drawing` draws them with matplotlib's Agg canvas (the optional `report` extra, imported only
there), `page` writes the escaped HTML, and `write` puts it all in a folder. Import from the
modules themselves.
"""
