"""Training data: datasets as host arrays, and the seeded sampler that deals each step's global
batch to the replicas (`batches`)."""
