"""Device side: the compiled step (forward + sampling), shape buckets, pools on device, compilation."""
