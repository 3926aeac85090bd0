"""The dask executor for lmlab: a sweep's variants and a preparation's tasks on a Dask cluster."""
