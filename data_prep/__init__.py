"""Data prep: ShareGPT reading (``sharegpt``), held-out split (``split``), chat templating and
loss masks (``template``), greedy labels (``labels``), the sharded safetensors cache (``cache``)
and the end-to-end driver (``pipeline``; CLI ``python -m data_prep``)."""
