"""The read path: pooled buffers, the fetcher and its readahead, the on-disk chunk cache, and the
small files fetched ahead of a walker."""
