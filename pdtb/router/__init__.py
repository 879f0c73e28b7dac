"""The router: the single HTTP front door (OpenAI `/v1/completions`), tokenisation and
detokenisation, the choice of nodes, and each request's end. It never holds KV.

    config.py      RouterConfig, ServedModel (tokenizer + limits), node specs
    openai_api.py  request parsing/validation, response and error shapes
    detok.py       incremental detokenizer and stop strings
    nodes.py       node registry: DEALER per node, pings, dispatch, event routing
    metrics.py     Prometheus metrics measured at the router
    completions.py one request's path: submit, stream events, abort on disconnect
    app.py         aiohttp application and handlers
    main.py        `pdtb router` entry point
"""
