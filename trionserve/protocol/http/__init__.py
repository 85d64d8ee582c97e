"""HTTP/REST frontend: the KServe v2 protocol plus Triton's extensions over HTTP/1.1 (httptools).

``codec`` turns JSON / binary-tensor bodies into core requests and back (pure), with
``tensor_data`` for a tensor's data (binary bytes or JSON array <-> numpy array),
``generate`` the same for the generate extension, ``transport`` the HTTP/1.1 server on
Trio sockets, ``frontend`` the route table and its handlers over the DataPlane."""
