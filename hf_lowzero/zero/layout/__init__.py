"""Where every element lives: each param's split over ranks, the managed params, the static bucket
plan, and the packing of buckets in the flat rank-major layout. Pure: no communication."""
