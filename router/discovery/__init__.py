"""Worker discovery sources behind one interface (:class:`router.discovery.base.DiscoverySource`)."""
