"""The partitioner controller (kopf): pending pods -> batches -> plans -> NodePartitioning specs."""
