"""The modelload operator: the ModelLoad resource, its status, and the pod injection webhook."""
