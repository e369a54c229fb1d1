module github.com/mcguard/mcguard

go 1.26

require github.com/stretchr/testify v1.12.1

require (
	github.com/pebbe/zmq4 v1.4.0 // indirect
	go.yaml.in/yaml/v3 v3.0.5 // indirect
)
