# Puma with Rack's MethodOverride, as Rails runs it: a POST whose X-HTTP-Method-Override
# (HTTP_X_HTTP_METHOD_OVERRIDE, which Puma also fills from X_HTTP_METHOD_OVERRIDE) names
# another method runs as that method. Counts what ran, by method.
require "json"
require "rack"
require "rack/method_override"

$executions = Hash.new(0)

use Rack::MethodOverride
run lambda { |env|
  if env["PATH_INFO"] == "/count"
    [200, { "content-type" => "application/json" }, [JSON.generate($executions)]]
  else
    method = env["REQUEST_METHOD"]
    $executions[method] += 1
    status = method == "POST" ? 201 : 200
    [status, { "content-type" => "application/json" }, [JSON.generate({ method: method, n: $executions[method] })]]
  end
}
