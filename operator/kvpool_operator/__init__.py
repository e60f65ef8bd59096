"""kvpool's Kubernetes operator (kopf): reconciles KVCachePool resources."""
