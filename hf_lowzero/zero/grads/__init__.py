"""From backward to this rank's gradient shard: one hook per bucket, plan-order reductions, the fp32
gradient store, and the norm of the rows."""
