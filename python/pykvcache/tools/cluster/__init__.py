"""Several vLLM servers on one shared pykvcache store, the vLLM project's router in front
(``pykvcache cluster``; docs/cluster.md)."""
