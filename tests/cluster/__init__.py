"""A real Kubernetes control plane (etcd + kube-apiserver) for tests."""
