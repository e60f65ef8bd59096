module kvpool.local/pause

go 1.22
