// The pod sandbox process of the test node (tests/cluster/node.py): it holds the pod's
// namespaces and sleeps until told to stop, like Kubernetes' pause image (which comes from a
// registry these machines cannot reach). Built by scripts/build_images.sh.
package main

import (
	"os"
	"os/signal"
	"syscall"
)

func main() {
	c := make(chan os.Signal, 1)
	signal.Notify(c, syscall.SIGINT, syscall.SIGTERM)
	<-c
}
