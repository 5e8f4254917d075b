"""Pictures of the course's ideas (issue 54): what a layer caches, prefill vs decode, block tables,
online softmax's merge, GQA/MLA shapes, eviction vs compaction, the engine's step loop, the offload
tiers, Quest's page bounds.

One module per picture family. Each function draws with matplotlib from the quantities it is
given (or kvlib computes), returns the `Figure`, and leaves showing it to the notebook. These are
diagrams, not data plots: nothing here measures anything.
"""
