module github.com/mcguard/mcguard

go 1.26

require (
	github.com/pebbe/zmq4 v1.4.0
	github.com/stretchr/testify v1.12.1
	github.com/zeebo/xxh3 v1.1.0
	golang.org/x/crypto v0.33.0
	golang.org/x/sys v0.30.0
)

require (
	github.com/klauspost/cpuid/v2 v2.2.10 // indirect
	go.yaml.in/yaml/v3 v3.0.5 // indirect
)
